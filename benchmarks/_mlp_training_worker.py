"""One rank of the MLP training benchmark (started by benchmarks/mlp_training.py; not run by hand).

Modes (first argument):

    stratagem SPEC OUT              one mirrored replica under ``stratagem.launch.launcher.launch``
    ddp-spawn SPEC OUT N            start N ``ddp-rank`` processes (gloo, rendezvous over tcp://127.0.0.1) and reap them
    ddp-rank SPEC OUT N RANK PORT|file:PATH

SPEC is a JSON file: ``{"label", "model": "numpy"|"torch", "sizes": [784, 512, 512, 10], "batch",
"warmup", "steps", "lr", "timeout", "job_timeout", "stratagem": {strategy options}}``. Rank 0 writes
OUT (JSON): per-step figures (reduced over the ranks, see below) and a description of the run.

The model is an MLP (ReLU between layers, softmax cross-entropy), float32, trained with plain SGD on a
synthetic batch of ``batch`` rows per rank (fixed random inputs and labels: the data pipeline is not
measured). Every process uses one math thread (``torch.set_num_threads(1)``, and OMP/MKL/OpenBLAS
set to 1 by the parent).

- ``stratagem``, model ``numpy``: forward and backward written with numpy matmuls; ``torch``: the
  same MLP as a ``torch.nn.Sequential`` whose parameters are views of the mirrored variables, gradients
  from ``loss.backward()``. Either way ``opt.apply_gradients`` all-reduces them (mirrored, zmq). Each
  step is timed in parts: compute (forward + backward), all-reduce (time inside the strategy's
  bucket all-reduces, measured by wrapping ``_Bucket.allreduce``: this is the communication, including
  any wait for a slower peer), sync (the strategy's whole gradient averaging: packing into buckets +
  all-reduce), and the rest of ``apply_gradients`` (the SGD update). Bytes: the payload this rank
  hands its transport (``send``/``send_async`` wrapped), per step.
- ``ddp``: the torch model wrapped in ``torch.nn.parallel.DistributedDataParallel`` over gloo
  (default buckets: 25 MiB, overlapping the all-reduce with the backward pass), ``torch.optim.SGD``.
  The timed loop (throughput, step times) is measured as stratagem's is. Then a second loop
  alternates a synced step with one under ``ddp.no_sync()`` (no communication at all; alternating so
  that both see the same outside load): the no_sync step time is DDP's compute time (forward,
  backward, update), and the difference between the pair's steps is the communication DDP could not
  hide behind the backward pass (``pair_step_s``, ``mean_compute_s``: means over the ranks). Bytes:
  the loopback interface's counters of the private network namespace the job runs in (every rank's
  traffic, TCP/IP headers included), divided by the ranks; without a namespace, not measured.

Per step, each rank times its own step with ``time.perf_counter``; after the loop the arrays are
reduced over the ranks: ``step_s`` (and stratagem's ``compute_s``) take the max (the slowest rank sets
the pace), ``mean_<part>_s`` the mean (stratagem: compute + apply = step, apply = sync + update, sync =
packing + allreduce), and ``allreduce_min_s`` the min (the all-reduce of the rank that arrived last,
which waited least).
Throughput is ``ranks * batch * steps`` over the slowest rank's wall time for the timed loop (which
starts after a collective that lines the ranks up).
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _die_with_parent() -> None:
    """preexec_fn: SIGKILL this child when its parent dies (Linux), so nothing is orphaned."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def synthetic_batch(sizes: list[int], batch: int, rank: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1000 + rank)
    return (rng.standard_normal((batch, sizes[0])).astype(np.float32),
            rng.integers(0, sizes[-1], batch).astype(np.int64))


def initial_params(sizes: list[int], seed: int = 0) -> list[tuple[str, np.ndarray]]:
    """``[("0.weight", (out, in)), ("0.bias", (out,)), ...]``: torch's names and layout, He-initialised."""
    rng = np.random.default_rng(seed)
    params = []
    for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        params.append((f"{2 * i}.weight", (rng.standard_normal((n_out, n_in)) * np.sqrt(2.0 / n_in)).astype(np.float32)))
        params.append((f"{2 * i}.bias", np.zeros(n_out, np.float32)))
    return params


# -- models: each offers grads() -> [(gradient, variable), ...] --------------------------------------

class NumpyMLP:
    """Forward and backward in float32 numpy (matmuls through numpy's BLAS)."""

    def __init__(self, variables: list, x: np.ndarray, y: np.ndarray):
        self.variables, self.x, self.y = variables, x, y
        self.onehot = np.zeros((len(y), variables[-1].shape[0]), np.float32)
        self.onehot[np.arange(len(y)), y] = 1.0

    def grads(self) -> list:
        ws = [v.value for v in self.variables[0::2]]
        bs = [v.value for v in self.variables[1::2]]
        acts = [self.x]
        for i, (w, b) in enumerate(zip(ws, bs)):
            z = acts[-1] @ w.T
            z += b
            if i < len(ws) - 1:
                np.maximum(z, 0.0, out=z)
            acts.append(z)
        logits = acts.pop()
        logits -= logits.max(axis=1, keepdims=True)
        np.exp(logits, out=logits)
        logits /= logits.sum(axis=1, keepdims=True)
        d = logits
        d -= self.onehot
        d *= np.float32(1.0 / len(self.y))
        out = []
        for i in range(len(ws) - 1, -1, -1):
            a = acts[i]
            out.append((d.sum(axis=0), self.variables[2 * i + 1]))
            out.append((d.T @ a, self.variables[2 * i]))
            if i:
                d = d @ ws[i]
                d *= a > 0
        return out


class TorchMLP:
    """``torch.nn.Sequential`` whose parameters are views of the variables; gradients from autograd."""

    def __init__(self, variables: list, x: np.ndarray, y: np.ndarray):
        import torch

        self.torch = torch
        self.module = build_torch_module([variables[0].shape[1]] + [v.shape[0] for v in variables[0::2]])
        self.pairs = []
        for (name, param), var in zip(self.module.named_parameters(), variables):
            assert name == var.name, (name, var.name)
            param.data = torch.from_numpy(var.value)
            self.pairs.append((param, var))
        self.x, self.y = torch.from_numpy(x), torch.from_numpy(y)

    def grads(self) -> list:
        import torch.nn.functional as F

        self.module.zero_grad(set_to_none=True)
        F.cross_entropy(self.module(self.x), self.y).backward()
        return [(param.grad.numpy(), var) for param, var in self.pairs]


def build_torch_module(sizes: list[int]):
    import torch

    layers = []
    for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(torch.nn.Linear(n_in, n_out))
        if i < len(sizes) - 2:
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)


# -- stratagem --------------------------------------------------------------------------------------

class Meter:
    """Time and bytes counted by the wrappers, for the step in progress."""

    def __init__(self):
        self.on = False
        self.allreduce_s = self.sync_s = 0.0
        self.calls = self.bytes = 0

    def reset(self) -> None:
        self.allreduce_s = self.sync_s = 0.0
        self.calls = self.bytes = 0


def instrument(strategy, meter: Meter) -> list[str]:
    """Wrap the strategy's bucket all-reduce, its gradient averaging and its transport's sends."""
    from stratagem.strategies.mirrored import strategy as mirrored

    how = []
    bucket_cls = getattr(mirrored, "_Bucket", None)
    if bucket_cls is not None and hasattr(bucket_cls, "allreduce"):
        original = bucket_cls.allreduce

        def timed_allreduce(self, comm, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return original(self, comm, *args, **kwargs)
            finally:
                if meter.on:
                    meter.allreduce_s += time.perf_counter() - t0
                    meter.calls += 1

        bucket_cls.allreduce = timed_allreduce
        how.append("all-reduce: mirrored._Bucket.allreduce timed")
    else:  # the strategy's internals changed: time the communicator's all-reduce instead
        comm = strategy.communicator
        original_comm = comm.allreduce

        def timed_comm_allreduce(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return original_comm(*args, **kwargs)
            finally:
                if meter.on:
                    meter.allreduce_s += time.perf_counter() - t0
                    meter.calls += 1

        comm.allreduce = timed_comm_allreduce
        how.append("all-reduce: Communicator.allreduce timed")
    if hasattr(strategy, "_average"):
        original_average = strategy._average

        def timed_average(pairs):
            t0 = time.perf_counter()
            try:
                return original_average(pairs)
            finally:
                if meter.on:
                    meter.sync_s += time.perf_counter() - t0

        strategy._average = timed_average
        how.append("sync: MirroredStrategy._average timed")
    transport = strategy.transport
    for method in ("send", "send_async"):
        original_send = getattr(transport, method)

        def counted(dst, tag, msg, *args, _send=original_send, **kwargs):
            if meter.on:
                meter.bytes += msg.nbytes
            return _send(dst, tag, msg, *args, **kwargs)

        setattr(transport, method, counted)
    how.append("bytes: payload of transport.send/send_async")
    return how


def run_stratagem(spec: dict, out_path: str) -> None:
    import stratagem

    sizes, batch = spec["sizes"], spec["batch"]
    options = dict(spec.get("stratagem") or {})
    transport = options.pop("transport", "zmq")
    if spec["model"] == "torch":
        import torch

        torch.set_num_threads(1)
    strategy = stratagem.strategy("mirrored", transport=transport, timeout=spec.get("timeout", 120), **options)
    try:
        rank, n = strategy.cluster.replicas().index(strategy.task), strategy.num_replicas_in_sync
        with strategy.scope():
            variables = [stratagem.Variable(value, name=name) for name, value in initial_params(sizes)]
            opt = stratagem.optimizers.SGD(learning_rate=spec["lr"])
        x, y = synthetic_batch(sizes, batch, rank)
        model = (TorchMLP if spec["model"] == "torch" else NumpyMLP)(variables, x, y)
        meter = Meter()
        how = instrument(strategy, meter)

        for _ in range(spec["warmup"]):
            opt.apply_gradients(model.grads())
        steps = spec["steps"]
        fields = ("step", "compute", "apply", "allreduce", "sync")
        t = {k: np.zeros(steps) for k in fields}
        calls, sent = np.zeros(steps), np.zeros(steps)
        strategy.reduce("sum", 0)                          # line the ranks up
        meter.on = True
        start = time.perf_counter()
        for i in range(steps):
            meter.reset()
            t0 = time.perf_counter()
            pairs = model.grads()
            t1 = time.perf_counter()
            opt.apply_gradients(pairs)
            t2 = time.perf_counter()
            t["step"][i], t["compute"][i], t["apply"][i] = t2 - t0, t1 - t0, t2 - t1
            t["allreduce"][i], t["sync"][i] = meter.allreduce_s, meter.sync_s
            calls[i], sent[i] = meter.calls, meter.bytes
        wall = time.perf_counter() - start
        meter.on = False

        grad_bytes = sum(v.value.nbytes for v in variables)
        result = {
            "label": spec["label"], "np": n, "model": spec["model"], "batch": batch, "steps": steps,
            "warmup": spec["warmup"], "wall_s": float(strategy.reduce("max", wall)),
            "step_s": strategy.reduce("max", t["step"]).tolist(),
            "compute_s": strategy.reduce("max", t["compute"]).tolist(),
            "allreduce_min_s": strategy.reduce("min", t["allreduce"]).tolist(),
            # The parts of a step, each the mean over the ranks (they add up to the mean step).
            **{f"mean_{k}_s": (strategy.reduce("sum", t[k]) / n).tolist() for k in fields},
            "allreduce_calls_per_step": float(np.median(calls)),
            "bytes_sent_per_step": float(strategy.reduce("sum", float(np.median(sent))) / n),
            "grad_bytes": int(grad_bytes),
            "info": {"instrumentation": how, "bucket_bytes": strategy.config.get("bucket_bytes"),
                     "compression": strategy.config.get("compression"), "transport": transport},
        }
        if strategy.is_chief:
            _write(out_path, result)
    finally:
        strategy.shutdown()


# -- DistributedDataParallel over gloo ----------------------------------------------------------------

def _lo_bytes() -> int | None:
    """Bytes sent on the loopback interface (of this network namespace), from /proc/net/dev."""
    try:
        with open("/proc/net/dev") as f:
            for line in f:
                name, _, data = line.partition(":")
                if name.strip() == "lo":
                    return int(data.split()[8])    # transmit bytes
    except (OSError, ValueError, IndexError):
        pass
    return None


def run_ddp_rank(spec: dict, out_path: str, n: int, rank: int, rendezvous: str) -> None:
    import datetime

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    init_method = ("file://" + rendezvous[len("file:"):] if rendezvous.startswith("file:")
                   else f"tcp://127.0.0.1:{int(rendezvous)}")
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=n,
                            timeout=datetime.timedelta(seconds=float(spec.get("timeout", 120))))
    try:
        sizes, batch = spec["sizes"], spec["batch"]
        module = build_torch_module(sizes)
        with torch.no_grad():
            for (name, param), (_, value) in zip(module.named_parameters(), initial_params(sizes)):
                param.copy_(torch.from_numpy(value))
        ddp = DistributedDataParallel(module)
        opt = torch.optim.SGD(ddp.parameters(), lr=spec["lr"])
        x, y = (torch.from_numpy(a) for a in synthetic_batch(sizes, batch, rank))

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(ddp(x), y).backward()
            opt.step()

        for _ in range(spec["warmup"]):
            step()
        steps = spec["steps"]
        # Phase 1, measured like stratagem's loop: synced steps only (throughput, step times).
        step_times = np.zeros(steps)
        dist.barrier()
        lo0 = _lo_bytes() if rank == 0 else None
        start = time.perf_counter()
        for i in range(steps):
            t0 = time.perf_counter()
            step()
            step_times[i] = time.perf_counter() - t0
        wall = time.perf_counter() - start
        lo1 = _lo_bytes() if rank == 0 else None
        moved = lo1 - lo0 if lo0 is not None and lo1 is not None else None
        # Phase 2: synced and unsynced steps alternate, so that both see the same outside load; the
        # difference is the communication that DDP did not hide.
        sync_times, local_times = np.zeros(steps), np.zeros(steps)
        dist.barrier()
        for i in range(steps):
            t0 = time.perf_counter()
            step()
            t1 = time.perf_counter()
            with ddp.no_sync():
                step()
            sync_times[i], local_times[i] = t1 - t0, time.perf_counter() - t1

        def reduce(a, op=dist.ReduceOp.MAX) -> np.ndarray:
            tensor = torch.from_numpy(np.array(a, np.float64))
            dist.all_reduce(tensor, op=op)
            return tensor.numpy()

        step_s, mean_step_s = reduce(step_times), reduce(step_times, dist.ReduceOp.SUM) / n
        pair_step_s = reduce(sync_times, dist.ReduceOp.SUM) / n
        mean_compute_s = reduce(local_times, dist.ReduceOp.SUM) / n
        wall = float(reduce([wall])[0])
        grad_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
        netns = os.environ.get("BENCH_NETNS") == "1"
        if rank == 0:
            _write(out_path, {
                "label": spec["label"], "np": n, "model": "torch", "batch": batch, "steps": steps,
                "warmup": spec["warmup"], "wall_s": wall, "step_s": step_s.tolist(), "mean_step_s": mean_step_s.tolist(),
                "pair_step_s": pair_step_s.tolist(), "mean_compute_s": mean_compute_s.tolist(),
                "bytes_sent_per_step": (moved / steps / n) if (netns and moved is not None) else None,
                "grad_bytes": int(grad_bytes),
                "info": {"ddp": "DistributedDataParallel(module), default buckets (bucket_cap_mb=25)",
                         "compute": "steps under ddp.no_sync(), alternating with synced steps (pair_step_s)",
                         "bytes": ("loopback tx counter of the job's private network namespace / ranks"
                                   if netns else "not measured (no private network namespace)")},
            })
        dist.barrier()                               # nobody leaves while a peer is still in a collective
    finally:
        dist.destroy_process_group()


def ddp_spawn(spec_path: str, out_path: str, n: int) -> int:
    """Start n DDP ranks, wait for them (with the job's timeout), and reap every one."""
    import socket

    with open(spec_path) as f:
        spec = json.load(f)
    if os.environ.get("BENCH_GLOO_RENDEZVOUS") == "file":
        rendezvous = "file:" + os.path.join(os.path.dirname(os.path.abspath(out_path)), "gloo-store")
    else:
        with socket.socket() as s:  # we are in a private network namespace: only loopback exists
            s.bind(("127.0.0.1", 0))
            rendezvous = str(s.getsockname()[1])
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", GLOO_SOCKET_IFNAME="lo", WORLD_SIZE=str(n))
    procs = []
    deadline = time.monotonic() + float(spec.get("job_timeout", 600))
    try:
        for rank in range(n):
            procs.append(subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "ddp-rank", spec_path, out_path, str(n), str(rank),
                 rendezvous],
                env=dict(env, RANK=str(rank)), stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent))
        pending = list(procs)
        while pending:
            for p in list(pending):
                rc = p.poll()
                if rc is not None:
                    pending.remove(p)
                    if rc != 0:
                        _log(f"ddp rank {procs.index(p)} exited with {rc}; stopping the others")
                        return 1
            if time.monotonic() > deadline:
                _log("ddp job timed out; stopping the ranks")
                return 124
            time.sleep(0.05)
        return 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _write(path: str, doc: dict) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(doc, f)
    os.replace(path + ".tmp", path)


def main(argv: list[str]) -> int:
    mode, spec_path, out_path = argv[0], argv[1], argv[2]
    if mode == "ddp-spawn":
        return ddp_spawn(spec_path, out_path, int(argv[3]))
    with open(spec_path) as f:
        spec = json.load(f)
    if mode == "stratagem":
        run_stratagem(spec, out_path)
    elif mode == "ddp-rank":
        run_ddp_rank(spec, out_path, int(argv[3]), int(argv[4]), argv[5])
        # Skip the interpreter's teardown: gloo's threads at exit sometimes abort the process
        # ("terminate called without an active exception") after the work is done and written.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
