#!/usr/bin/env python3
"""The hops of one parameter-server push (issue #25 item 6): the chain of calls from the user's
``optimizer.apply_gradients`` on a worker to the transport's ``send_async`` (the bytes leaving), and on
the ps task from the request taken off the transport (``ParameterServer.serve``) to the optimizer
updating the variable; a dense gradient and a row gradient (``IndexedSlices``). Also counts the
calls from ``stratagem/ps_service/`` back up into ``stratagem/strategies/ps/`` made during the push.

    PYTHONPATH=src python benchmarks/ps_push_hops.py              # this tree
    PYTHONPATH=/path/to/other/src python benchmarks/ps_push_hops.py   # another tree, to compare

A chain is read off the stack (``sys.setprofile``) at the hand-off, so it lists exactly the nested
calls in between, stratagem's frames only (numpy, the standard library and C calls left out). One
worker and one ps task as threads of one process over the ``local`` transport: a chain does not
depend on the transport below ``send_async``. Not a timing: the figures do not depend on the load.
"""

from __future__ import annotations

import os
import sys
import threading

import numpy as np

import stratagem
from stratagem.core.cluster import ClusterSpec
from stratagem.transports.local import LocalFabric

SRC = os.path.dirname(stratagem.__file__)


def _stack(frame) -> list[tuple[str, str]]:
    stack = []
    while frame is not None:
        code = frame.f_code
        if code.co_filename.startswith(SRC):
            stack.append((os.path.relpath(code.co_filename, SRC), getattr(code, "co_qualname", code.co_name)))
        frame = frame.f_back
    return stack[::-1]


def measure(rows: bool) -> dict:
    chains: dict[str, list] = {}
    up: list[str] = []
    entered: dict[str, set] = {"worker:0": set(), "ps:0": set()}    # every stratagem function a push enters
    window = threading.Event()                                      # set while the measured push runs
    depth: dict[str, list] = {"worker:0": []}

    def profile(frame, event, arg):
        if event != "call":
            return
        who, code = threading.current_thread().name, frame.f_code
        if who in entered and window.is_set() and code.co_filename.startswith(SRC):
            entered[who].add((os.path.relpath(code.co_filename, SRC), getattr(code, "co_qualname", code.co_name)))
        if who == "worker:0" and code.co_name == "send_async" and "worker" not in chains:
            chains["worker"] = _stack(frame)
        elif who == "ps:0" and code.co_name in ("update_array", "update_rows") and code.co_filename.startswith(SRC):
            chains.setdefault("server", _stack(frame))
        if who == "worker:0" and code.co_filename.startswith(os.path.join(SRC, "strategies", "ps")):
            caller = frame.f_back
            # the service: stratagem/ps_service/ (stratagem/ps/ in trees before issue #25's renames)
            if caller is not None and caller.f_code.co_filename.startswith(
                    (os.path.join(SRC, "ps_service") + os.sep, os.path.join(SRC, "ps") + os.sep)):
                up.append(f"{caller.f_code.co_name} -> {code.co_name}")

    cluster, fabric = ClusterSpec({"worker": ["local:0"], "ps": ["local:1"]}), LocalFabric()

    def task(name: str) -> None:
        if name.startswith("ps"):
            threading.setprofile(None)
            sys.setprofile(profile)
        strategy = stratagem.strategy("between_graph", transport="local", cluster=cluster, task=name,
                                      exit_after_serving=False, transport_options={"fabric": fabric, "timeout": 30})
        with strategy:
            if name.startswith("ps"):
                return
            with strategy.scope():
                w = stratagem.Variable(np.zeros((8, 4), np.float32), name="w")
                opt = stratagem.optimizers.SGD(learning_rate=0.5)
            grad = (stratagem.IndexedSlices(np.ones((2, 4), np.float32), np.array([1, 3]), (8, 4)) if rows
                    else np.ones((8, 4), np.float32))
            opt.apply_gradients([(grad, w)])        # the first push also sends the optimizer
            sys.setprofile(profile)
            window.set()
            opt.apply_gradients([(grad, w)])
            window.clear()
            sys.setprofile(None)

    threads = [threading.Thread(target=task, args=(t,), name=t) for t in ("ps:0", "worker:0")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    out = {}
    for side, start in (("worker", "Optimizer.apply_gradients"), ("server", "ParameterServer.serve")):
        chain = chains[side]
        chain = chain[max(i for i, (_, q) in enumerate(chain) if q == start):]
        out[side] = chain
    out["up"] = up
    out["entered"] = {side: entered[name] for side, name in (("worker", "worker:0"), ("server", "ps:0"))}
    return out


def main() -> None:
    print(f"stratagem from {SRC}")
    for rows in (False, True):
        result = measure(rows)
        print(f"\n{'row gradient (IndexedSlices)' if rows else 'dense gradient'}:")
        for side in ("worker", "server"):
            chain = result[side]
            print(f"  {side}: {len(chain) - 1} hops through {len({m for m, _ in chain})} modules")
            for module, name in chain:
                print(f"      {module}: {name}")
        for side in ("worker", "server"):
            functions = result["entered"][side]
            print(f"  {side}: the push enters {len(functions)} stratagem functions in "
                  f"{len({m for m, _ in functions})} modules")
        print(f"  calls from the ps service back up into stratagem/strategies/ps: {len(result['up'])} "
              f"{sorted(set(result['up']))}")


if __name__ == "__main__":
    main()
