"""One task of an ``in_graph`` job training the MLP of mirrored_model.py (tests/test_in_graph.py).

Every task runs this same script. ``worker:0`` is the client; the other worker tasks serve inside
``stratagem.strategy("in_graph", ...)`` and exit when the client is done. The step function is defined
at the top level, so the replicas find it by name (they import this script, whose training loop is
under the main guard); ``--functions pickle`` sends it serialized instead (needs STRATAGEM_SECRET).

    in_graph_train.py --out DIR --steps M [--batch B] [--optimizer sgd|adam] [--devices N]
                      [--functions auto|name|pickle] [--on-failure raise|continue]
                      [--die-at K --die-task worker:2] [--crash-client-at K]
                      [--timeout S] [--peer-timeout S] [--no-shutdown]

The client writes ``DIR/params.npz`` (final parameters) and ``DIR/record.json`` (losses, rows per
replica, replicas, lost replicas, bytes sent per step); if ``run`` raises, ``DIR/error.json`` (type,
task named by the error, message, step, seconds from the start of the step) and exits 3.
``--die-at K``: the task ``--die-task`` SIGKILLs itself inside step K. ``--crash-client-at K``: the
client SIGKILLs itself before step K (the workers must notice and exit). ``--no-shutdown``: the client
ends without calling ``strategy.shutdown()`` (the strategy does it at exit).
"""

import argparse
import json
import os
import signal
import sys
import time

import numpy as np

import mirrored_model as model
import stratagem

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--steps", type=int, required=True)
parser.add_argument("--batch", type=int, default=25)
parser.add_argument("--optimizer", default="sgd")
parser.add_argument("--devices", type=int, default=1)
parser.add_argument("--functions", default="auto")
parser.add_argument("--on-failure", default="raise")
parser.add_argument("--die-at", type=int)
parser.add_argument("--die-task")
parser.add_argument("--crash-client-at", type=int)
parser.add_argument("--timeout", type=float, default=30.0)
parser.add_argument("--peer-timeout", type=float, default=5.0)
parser.add_argument("--no-shutdown", action="store_true")
args = parser.parse_args()

strategy = stratagem.strategy(
    "in_graph", transport="zmq", devices=args.devices, functions=args.functions,
    on_replica_failure=args.on_failure, timeout=args.timeout,
    transport_options={"timeout": args.timeout, "peer_timeout": args.peer_timeout},
)
with strategy.scope():
    # A replica's copy of the script makes other initial values: the client's must win.
    params, opt = model.create(args.optimizer, seed=1 if strategy.is_chief else 7)


def train_step(x, y, step):
    if step == args.die_at and strategy.task.short == args.die_task:
        os.kill(os.getpid(), signal.SIGKILL)
    return model.train_step(params, opt, x, y)


def count_bytes(record: dict) -> None:
    """Record the payload the client hands its transport during each step."""
    transport = strategy.transport
    original = transport.send_async

    def counted(dst, tag, msg, *a, **kw):
        record["bytes"][-1] += msg.nbytes
        return original(dst, tag, msg, *a, **kw)

    transport.send_async = counted


def main() -> None:
    os.makedirs(args.out, exist_ok=True)
    record = {"replicas": strategy.replicas, "losses": [], "rows": [], "bytes": [], "pid": os.getpid()}
    count_bytes(record)
    step, began = 0, time.monotonic()
    try:
        for step, (x, y) in enumerate(model.global_batches(0, args.steps, args.batch)):
            if step == args.crash_client_at:
                os.kill(os.getpid(), signal.SIGKILL)
            record["bytes"].append(0)
            began = time.monotonic()
            out = strategy.run(train_step, args=(x, y, step))
            record["losses"].append(strategy.reduce("mean", out))
            record["rows"].append(list(out.rows))
    except stratagem.StratagemError as exc:
        with open(os.path.join(args.out, "error.json"), "w") as f:
            json.dump({"type": type(exc).__name__, "task": str(getattr(exc, "task", "")), "message": str(exc),
                       "step": step, "seconds": time.monotonic() - began}, f)
        print(f"client: {exc}", file=sys.stderr)
        strategy.shutdown()
        sys.exit(3)
    record.update(lost=strategy.lost_replicas, replicas_at_end=strategy.replicas, iterations=opt.iterations)
    np.savez(os.path.join(args.out, "params.npz"), **{name: var.numpy() for name, var in params.items()})
    with open(os.path.join(args.out, "record.json"), "w") as f:
        json.dump(record, f)
    if not args.no_shutdown:
        strategy.shutdown()


if __name__ == "__main__":
    main()
