#!/usr/bin/env python3
"""The hops of one all-reduce (issue #25's acceptance, beside ``ps_push_hops.py``): the chain of nested
stratagem calls from the user's ``comm.allreduce`` to the first message handed to the transport (the
first ``send``/``send_async`` entered outside ``collectives/``), and every stratagem function the call enters, on rank 0 of a
2-rank job, for a small (4 KB) and a large (1 MB, several chunks) float32 sum.

    stratagem launch --worker 2 -- python3 benchmarks/allreduce_hops.py             # this tree
    PYTHONPATH=/other/src stratagem launch --worker 2 -- python3 benchmarks/allreduce_hops.py

A chain is read off the stack (``sys.setprofile``) at the hand-off, stratagem's frames only (numpy,
the standard library and C calls left out); the call measured is the third of its size (the first
ones set up plans and caches). Not a timing. The chain does not depend on the load; the count of
functions entered does a little: a receive that finds the peer's message already filed enters fewer
than one that waits for it (run it a few times).
"""

from __future__ import annotations

import os
import sys
import threading

import numpy as np

import stratagem

SRC = os.path.dirname(stratagem.__file__)


def _where(code) -> tuple[str, str]:
    return os.path.relpath(code.co_filename, SRC), getattr(code, "co_qualname", code.co_name)


def _stack(frame) -> list[tuple[str, str]]:
    stack = []
    while frame is not None:
        if frame.f_code.co_filename.startswith(SRC):
            stack.append(_where(frame.f_code))
        frame = frame.f_back
    return stack[::-1]


def measure(comm, nbytes: int) -> dict:
    x = np.ones(nbytes // 4, np.float32)
    for _ in range(2):
        comm.allreduce(x, op="sum")
    me = threading.get_ident()
    chain: list = []
    entered: set = set()

    def profile(frame, event, arg):
        if event != "call" or threading.get_ident() != me or not frame.f_code.co_filename.startswith(SRC):
            return
        entered.add(_where(frame.f_code))
        if not chain and frame.f_code.co_name in ("send", "send_async") and not _where(frame.f_code)[0].startswith("collectives"):
            chain.extend(_stack(frame))

    sys.setprofile(profile)
    comm.allreduce(x, op="sum")
    sys.setprofile(None)
    start = max(i for i, (_, q) in enumerate(chain) if q.endswith("allreduce") and "Communicator" in q)
    return {"chain": chain[start:], "entered": entered}


def main() -> None:
    comm = stratagem.communicator()
    results = {n: measure(comm, n) for n in (4096, 1 << 20)}
    if comm.rank == 0:
        print(f"stratagem from {SRC}, {comm.size} ranks")
        for n, r in results.items():
            chain, entered = r["chain"], r["entered"]
            print(f"\nall-reduce of {n} bytes, rank 0: {len(chain) - 1} hops to the first send, through "
                  f"{len({m for m, _ in chain})} modules")
            for module, name in chain:
                print(f"    {module}: {name}")
            print(f"  the call enters {len(entered)} stratagem functions in {len({m for m, _ in entered})} modules")
    comm.close()


if __name__ == "__main__":
    main()
